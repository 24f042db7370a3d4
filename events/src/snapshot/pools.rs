//! Pinned pools: size classes, slabs in use, exhaustion and pageable fallbacks.

use super::super::model::*;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::PoolConfigured {
            pool,
            classes,
            pinned,
        } => {
            if classes.len() > MAX_POOL_CLASSES {
                return s.refuse(Refusal::ListTooLong);
            }
            *pool_mut(s, *pool) = PoolView {
                pinned: *pinned,
                classes: classes
                    .iter()
                    .map(|c| ClassView {
                        slab_bytes: c.slab_bytes,
                        slabs: c.slabs,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            };
            super::counts::refresh_pools(s);
        }
        // Hits, misses, pageable bytes and waits are counts (`counts`); here only what is
        // taken now.
        EventKind::SlabAcquired { pool, class, .. } => {
            let Some(c) = class_mut(s, *pool, *class) else { return };
            c.in_use = c.in_use.saturating_add(1);
            c.peak_in_use = c.peak_in_use.max(c.in_use);
        }
        EventKind::SlabReleased { pool, class, .. } => {
            let Some(c) = class_mut(s, *pool, *class) else { return };
            c.in_use = c.in_use.saturating_sub(1);
        }
        // The class must be one a pool can have (else refused); the miss is a count.
        EventKind::PoolExhausted { pool, class, .. } if class_mut(s, *pool, *class).is_some() => {
            super::counts::refresh_pools(s);
        }
        _ => {}
    }
}

fn pool_mut(s: &mut Snapshot, pool: PoolKind) -> &mut PoolView {
    let slot = match pool {
        PoolKind::Weights => &mut s.weight_pool,
        PoolKind::Activations => &mut s.activation_pool,
    };
    slot.get_or_insert_with(PoolView::default)
}

/// The view of one size class, grown on demand up to [`MAX_POOL_CLASSES`]; a class past the
/// bound is refused (it would otherwise size a vector from the event).
fn class_mut(s: &mut Snapshot, pool: PoolKind, class: u32) -> Option<&mut ClassView> {
    let i = class as usize;
    if i >= MAX_POOL_CLASSES {
        s.refuse(Refusal::PoolClassOutOfRange);
        return None;
    }
    let p = pool_mut(s, pool);
    if p.classes.len() <= i {
        p.classes.resize(i + 1, ClassView::default());
    }
    Some(&mut p.classes[i])
}
