//! The messages queued for a segment's registrant (NIXL's notifications): bounded in number
//! and bytes, so a receiver that does not take them stops its senders, not the agent.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use kvfabric_proto::limits::{MAX_QUEUED_NOTIFICATION_BYTES, MAX_QUEUED_NOTIFICATIONS};
use tokio::sync::Notify;

use crate::error::{Error, Result};

/// One message and who sent it (the sender's own word).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub sender: String,
    pub message: Vec<u8>,
}

#[derive(Debug, Default)]
pub struct Inbox {
    queue: Mutex<Queue>,
    arrived: Notify,
}

#[derive(Debug, Default)]
struct Queue {
    messages: VecDeque<Notification>,
    bytes: usize,
}

impl Inbox {
    pub fn push(&self, n: Notification) -> Result<()> {
        let size = n.sender.len() + n.message.len();
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.messages.len() >= MAX_QUEUED_NOTIFICATIONS {
            return Err(Error::Exhausted {
                resource: "notifications queued for the segment",
                limit: MAX_QUEUED_NOTIFICATIONS,
            });
        }
        if q.bytes + size > MAX_QUEUED_NOTIFICATION_BYTES {
            return Err(Error::Exhausted {
                resource: "bytes of notifications queued for the segment",
                limit: MAX_QUEUED_NOTIFICATION_BYTES,
            });
        }
        q.bytes += size;
        q.messages.push_back(n);
        drop(q);
        self.arrived.notify_waiters();
        Ok(())
    }

    /// Up to `max` (0: all) messages, oldest first; waits up to `wait` for one when none is
    /// queued.
    pub async fn take(&self, max: usize, wait: Duration) -> Vec<Notification> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before looking, so a push between the look and the wait wakes it.
            let arrived = self.arrived.notified();
            let taken = self.drain(max);
            if !taken.is_empty() || tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return taken;
            }
        }
    }

    fn drain(&self, max: usize) -> Vec<Notification> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let n = if max == 0 {
            q.messages.len()
        } else {
            max.min(q.messages.len())
        };
        let taken: Vec<Notification> = q.messages.drain(..n).collect();
        q.bytes -= taken
            .iter()
            .map(|m| m.sender.len() + m.message.len())
            .sum::<usize>();
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(i: usize, len: usize) -> Notification {
        Notification {
            sender: format!("s{i}"),
            message: vec![i as u8; len],
        }
    }

    #[tokio::test]
    async fn messages_come_out_in_order_and_a_waiter_wakes_for_one() {
        let inbox = std::sync::Arc::new(Inbox::default());
        for i in 0..5 {
            inbox.push(note(i, 3)).unwrap();
        }
        assert_eq!(
            inbox.take(2, Duration::ZERO).await,
            vec![note(0, 3), note(1, 3)]
        );
        assert_eq!(inbox.take(0, Duration::ZERO).await.len(), 3);
        let waiting = tokio::spawn({
            let inbox = inbox.clone();
            async move { inbox.take(0, Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        inbox.push(note(9, 1)).unwrap();
        assert_eq!(waiting.await.unwrap(), vec![note(9, 1)]);
        assert!(inbox.take(0, Duration::from_millis(5)).await.is_empty());
    }

    #[test]
    fn a_full_queue_refuses_and_frees_what_is_taken() {
        let inbox = Inbox::default();
        let big = MAX_QUEUED_NOTIFICATION_BYTES / 4;
        for i in 0..3 {
            inbox.push(note(i, big)).unwrap();
        }
        let e = inbox.push(note(3, big)).unwrap_err();
        assert!(matches!(e, Error::Exhausted { .. }), "{e}");
        assert_eq!(inbox.drain(1).len(), 1);
        inbox.push(note(3, big)).unwrap();
        let inbox = Inbox::default();
        for i in 0..MAX_QUEUED_NOTIFICATIONS {
            inbox.push(note(i, 0)).unwrap();
        }
        assert!(inbox.push(note(0, 0)).is_err());
    }
}
