//! A bound on each gRPC method's request body, enforced as the bytes arrive (before tonic
//! buffers or decodes a message), so a caller can make the agent hold at most its method's
//! limit per call. Beyond it the call fails with `RESOURCE_EXHAUSTED` naming the method.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;

/// The body of one request, cut off past `limit` bytes.
#[derive(Debug)]
pub(crate) struct Limited {
    inner: Body,
    left: usize,
    limit: usize,
    method: String,
}

impl HttpBody for Limited {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            match self.left.checked_sub(data.len()) {
                Some(left) => self.left = left,
                None => {
                    return Poll::Ready(Some(Err(Status::resource_exhausted(format!(
                        "{}: the request is larger than this method's limit of {} bytes",
                        self.method, self.limit
                    )))));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Wraps each request body with the limit `limit_of` gives its path (`/package.Service/Method`).
pub(crate) fn layer(
    limit_of: impl Fn(&str) -> usize + Clone,
) -> tower::util::MapRequestLayer<impl Fn(http::Request<Body>) -> http::Request<Body> + Clone> {
    tower::util::MapRequestLayer::new(move |req: http::Request<Body>| {
        let method = req.uri().path().to_owned();
        let limit = limit_of(&method);
        req.map(|inner| {
            Body::new(Limited {
                inner,
                left: limit,
                limit,
                method,
            })
        })
    })
}
