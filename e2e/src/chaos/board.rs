//! Where workers publish the source segment they serve, and find the others'.

use std::sync::{Arc, Mutex};

use kvfabric_client::HostMemory;

/// A worker's source segment of one generation, with the bytes every pull of it must bring.
#[derive(Debug, Clone)]
pub struct Published {
    pub generation: u64,
    pub name: String,
    /// Its destination segment (registered too: etcd holds both).
    pub dst_name: String,
    pub key: u64,
    pub src: Arc<HostMemory>,
}

#[derive(Debug)]
pub struct Board {
    slots: Mutex<Vec<Option<Published>>>,
}

impl Board {
    pub fn new(workers: usize) -> Board {
        Board {
            slots: Mutex::new(vec![None; workers]),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Option<Published>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn publish(&self, slot: usize, p: Published) {
        self.slots()[slot] = Some(p);
    }

    /// Takes `slot`'s entry off the board if it is still of `generation`.
    pub fn withdraw(&self, slot: usize, generation: u64) {
        let mut slots = self.slots();
        if slots[slot]
            .as_ref()
            .is_some_and(|p| p.generation == generation)
        {
            slots[slot] = None;
        }
    }

    /// Takes `slot`'s entry off the board whatever its generation (its worker was killed).
    pub fn clear(&self, slot: usize) {
        self.slots()[slot] = None;
    }

    /// The source worker `slot` pulls in its round `round`: the others in turn, skipping
    /// those not published.
    pub fn next_source(&self, slot: usize, round: u64) -> Option<(usize, Published)> {
        let slots = self.slots();
        let others: Vec<usize> = (0..slots.len())
            .filter(|&j| j != slot && slots[j].is_some())
            .collect();
        let j = *others.get(round as usize % others.len().max(1))?;
        slots[j].clone().map(|p| (j, p))
    }

    /// Segment names every published worker has registered.
    pub fn segment_names(&self) -> Vec<String> {
        self.slots()
            .iter()
            .flatten()
            .flat_map(|p| [p.name.clone(), p.dst_name.clone()])
            .collect()
    }
}
