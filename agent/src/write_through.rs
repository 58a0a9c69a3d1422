//! Stream wrappers that act on what a connection reads (`incoming::Capped` cuts a connection
//! that does not prove itself in time, `authority::AuthorityRewrite` rewrites header blocks) pass every write straight to the
//! stream they wrap: one definition of that pass-through for all of them.

/// `impl AsyncWrite for $wrapper<T>` by forwarding every call to its field `io`.
macro_rules! write_through {
    ($wrapper:ident) => {
        impl<T: ::tokio::io::AsyncWrite + Unpin> ::tokio::io::AsyncWrite for $wrapper<T> {
            fn poll_write(
                mut self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
                buf: &[u8],
            ) -> ::std::task::Poll<::std::io::Result<usize>> {
                ::std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
            }
            fn poll_flush(
                mut self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
            ) -> ::std::task::Poll<::std::io::Result<()>> {
                ::std::pin::Pin::new(&mut self.io).poll_flush(cx)
            }
            fn poll_shutdown(
                mut self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
            ) -> ::std::task::Poll<::std::io::Result<()>> {
                ::std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
            }
            fn poll_write_vectored(
                mut self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
                bufs: &[::std::io::IoSlice<'_>],
            ) -> ::std::task::Poll<::std::io::Result<usize>> {
                ::std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
            }
            fn is_write_vectored(&self) -> bool {
                self.io.is_write_vectored()
            }
        }
    };
}

pub(crate) use write_through;
