//! One line of text per event, for every event log (the terminal UI's and the web page's) and
//! the block details: what the event says, with sizes in binary units.

use super::model::*;

/// [`bytes`] under a name no event's field shadows.
use self::bytes as fmt_bytes;

/// Three significant digits: 999 -> "999", 1234 -> "1.23k", 14_600 -> "14.6k",
/// 146_000 -> "146k", 3_200_000 -> "3.20M".
pub fn three_digits(v: f64) -> String {
    if v >= 99.95 {
        format!("{v:.0}")
    } else if v >= 9.995 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Bytes in binary units: "512 B", "1.00 KiB", "48.0 MiB", "920 MiB", "1.00 GiB".
pub fn bytes(b: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1023.5 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{} {}", three_digits(v), UNITS[u])
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// Hints as "h2d<=1 d2h<=2 window<=1 no-spec".
pub fn fmt_hints(h: &Hints) -> String {
    let mut s = format!(
        "h2d<={} d2h<={} window<={}",
        opt(h.max_inflight_h2d),
        opt(h.max_inflight_d2h),
        opt(h.prefetch_window_cap)
    );
    if h.suppress_speculative {
        s.push_str(" no-speculative");
    }
    s
}


/// One line saying what an event says, for the Events log.
pub fn describe(k: &EventKind) -> String {
    use EventKind::*;
    match k {
        RunStarted { run_id, model, device, .. } => format!("{run_id}: {model} on {}", device.name),
        RunEnded { steps } => format!("after {steps} steps"),
        PhaseChanged { from, to, duration_s } => {
            format!("{from} -> {to} ({:.1} ms)", duration_s * 1e3)
        }
        BlockRegistered { block, name, bytes, trainable, .. } => format!(
            "#{block} {name} {}{}",
            fmt_bytes(*bytes),
            if *trainable { " trainable" } else { "" }
        ),
        ItineraryLearned { order } => format!("{} blocks", order.len()),
        Quantized(r) => format!(
            "#{} {} {}: {} -> {}, error max {:.3}% mean {:.3}%",
            r.block,
            r.name,
            r.format,
            fmt_bytes(r.full_bytes),
            fmt_bytes(r.quantized_bytes),
            r.max_rel_error * 100.0,
            r.mean_rel_error * 100.0
        ),
        ModelRegistered { model, blocks, frozen, quantized } => format!(
            "{model}: {} blocks{}{}",
            blocks.len(),
            if *frozen { " frozen" } else { "" },
            quantized.map_or(String::new(), |q| format!(" {q}"))
        ),
        ModelMemory { models } => models
            .iter()
            .map(|m| format!("{} {} ({}/{} on device)", m.model, fmt_bytes(m.device_bytes), m.on_device, m.blocks))
            .collect::<Vec<_>>()
            .join(", "),
        Residency { block, from, to, refcount } => {
            format!("#{block} {from} -> {to} ref={refcount}")
        }
        PrefetchHit { block } => format!("#{block}"),
        PrefetchMiss { block, stall_ms } => format!("#{block} stalled {stall_ms:.2} ms"),
        HostStep { block, queued_ms, waited_ms, ran_ms } => {
            format!("#{block} ran {ran_ms:.2} ms (queued {queued_ms:.2} ms, waited {waited_ms:.2} ms for its copies)")
        }
        Eviction { block, reason, score, bytes } => format!(
            "#{block} {} {} score {score:.2e}",
            wire_name(reason),
            fmt_bytes(*bytes)
        ),
        PrefetchWindow { cursor, backward, window } => format!(
            "cursor {cursor}{} window {:?}",
            if *backward { " (backward)" } else { "" },
            window.iter().map(|b| b.0).collect::<Vec<_>>()
        ),
        Protection { block, protected } => format!(
            "#{block} {}",
            if *protected { "protected" } else { "unprotected" }
        ),
        TransferIssued { id, dir, owner, bytes, subject } => format!(
            "{} #{id} {} {} {subject}",
            dir.as_str(),
            owner.as_str(),
            fmt_bytes(*bytes)
        ),
        TransferCompleted { id, dir, owner, bytes, duration_ms } => format!(
            "{} #{id} {} {}{}",
            dir.as_str(),
            owner.as_str(),
            fmt_bytes(*bytes),
            match duration_ms {
                Some(ms) => format!(" in {ms:.2} ms"),
                None => " (not timed)".to_owned(),
            }
        ),
        PoolConfigured { pool, classes, pinned } => format!(
            "{} {} classes{}",
            wire_name(pool),
            classes.len(),
            if *pinned { " pinned" } else { "" }
        ),
        SlabAcquired { pool, class, slab, waited_ms, .. } => {
            format!("{} class {class} slab {slab} waited {waited_ms:.2} ms", wire_name(pool))
        }
        SlabReleased { pool, class, slab } => format!("{} class {class} slab {slab}", wire_name(pool)),
        PoolExhausted { pool, class, requested_bytes } => format!(
            "{} class {class} wanted {}",
            wire_name(pool),
            fmt_bytes(*requested_bytes)
        ),
        PageableFallback { pool, bytes } => format!("{} {}", wire_name(pool), fmt_bytes(*bytes)),
        Pack { tensor, decision, reason, bytes, .. } => format!(
            "t{tensor} {}{} {}",
            wire_name(decision),
            reason.map(|r| format!(" ({})", wire_name(&r))).unwrap_or_default(),
            fmt_bytes(*bytes)
        ),
        SpillFinalized { tensor, bytes, inline } => format!(
            "t{tensor} {}{}",
            fmt_bytes(*bytes),
            if *inline { " inline" } else { "" }
        ),
        Restored { tensor, bytes, predicted, stall_ms } => format!(
            "t{tensor} {}{} stall {stall_ms:.2} ms",
            fmt_bytes(*bytes),
            if *predicted { " predicted" } else { "" }
        ),
        SpillingToggled { on, vram_allocated_bytes } => format!(
            "{} at {}",
            if *on { "on" } else { "off" },
            fmt_bytes(*vram_allocated_bytes)
        ),
        Reservation { id, owner, mode, priority, requested_bytes, granted_bytes, outcome, reason, .. } => {
            format!(
                "r{id} {} {} {} {}/{} {}{}",
                owner.as_str(),
                wire_name(mode),
                wire_name(priority),
                fmt_bytes(*granted_bytes),
                fmt_bytes(*requested_bytes),
                wire_name(outcome),
                reason.map(|r| format!(" ({})", r.as_str())).unwrap_or_default()
            )
        }
        ReservationReleased { id, bytes } => format!("r{id} {}", fmt_bytes(*bytes)),
        SlotGranted { dir, owner, speculative, inflight } => format!(
            "{} {}{} inflight {inflight}",
            dir.as_str(),
            owner.as_str(),
            if *speculative { " speculative" } else { "" }
        ),
        SlotDenied { dir, owner, speculative, reason } => format!(
            "{} {}{} {}",
            dir.as_str(),
            owner.as_str(),
            if *speculative { " speculative" } else { "" },
            reason.as_str()
        ),
        SlotReleased { dir, owner, inflight } => {
            format!("{} {} inflight {inflight}", dir.as_str(), owner.as_str())
        }
        HintsChanged { hints, rule } => format!("{}: {}", wire_name(rule), fmt_hints(hints)),
        VramSample { allocated_bytes, reserved_bytes, .. } => format!(
            "{} allocated, {} reserved",
            fmt_bytes(*allocated_bytes),
            fmt_bytes(*reserved_bytes)
        ),
        WeightStep(m) => format!(
            "hits {} misses {} stall {:.1} ms",
            m.prefetch_hits, m.prefetch_misses, m.stall_time_ms
        ),
        ActivationStep(m) => format!(
            "saved {} spilled {} restored {}",
            m.activations_saved, m.activations_spilled, m.activations_restored
        ),
        ConductorStep(m) => format!(
            "grants {} partial {} denied {}",
            m.grant_count, m.partial_count, m.deny_count
        ),
        TrainStep(m) => format!("loss {:.4} in {:.1} ms", m.loss, m.step_time_s * 1e3),
        Evaluation(m) => format!(
            "{} block uses, hits {} misses {} in {:.1} ms",
            m.block_uses, m.prefetch_hits, m.prefetch_misses, m.duration_ms
        ),
        TransferStep(m) => format!(
            "h2d {} copies {}, d2h {} copies {}",
            m.h2d.count,
            fmt_bytes(m.h2d.bytes),
            m.d2h.count,
            fmt_bytes(m.d2h.bytes)
        ),
        StepCounts(c) => {
            let evictions: u64 = c.evictions.values().sum();
            let copies: u64 = c.copies.values().flat_map(|o| o.values()).map(|n| n.count).sum();
            let denials: u64 = c.reservation_denials.values().chain(c.slot_denials.values()).sum();
            format!("{copies} copies, {evictions} evictions, {denials} Conductor refusals")
        }
        WatermarksMoved { from_high_bytes, from_low_bytes, high_bytes, low_bytes, reason } => format!(
            "{}/{} -> {}/{}: {reason}",
            fmt_bytes(*from_high_bytes),
            fmt_bytes(*from_low_bytes),
            fmt_bytes(*high_bytes),
            fmt_bytes(*low_bytes)
        ),
        Warning { source, message } => format!("{}: {message}", source.as_str()),
        EventsDropped { total } => format!("{total} dropped so far"),
        LimitsSet { owner, budget_bytes, high_watermark_bytes, low_watermark_bytes } => {
            let mut s = format!("{} budget {}", owner.as_str(), fmt_bytes(*budget_bytes));
            if let Some(h) = high_watermark_bytes {
                s.push_str(&format!(", high {}", fmt_bytes(*h)));
            }
            if let Some(l) = low_watermark_bytes {
                s.push_str(&format!(", low {}", fmt_bytes(*l)));
            }
            s
        }
        VramOwners(o) => format!(
            "weights {} kept {} restored {} in flight {} other {}",
            fmt_bytes(o.weights_bytes),
            fmt_bytes(o.activations_kept_bytes),
            fmt_bytes(o.activations_restored_bytes),
            fmt_bytes(o.copies_in_flight_bytes),
            fmt_bytes(o.other_bytes)
        ),
        OutOfMemory { requested_bytes, doing, .. } => {
            format!("out of memory asking {} while {doing}", fmt_bytes(*requested_bytes))
        }
        ItineraryChanged { order, first_difference, .. } => {
            format!("retraced: {} blocks, differs from position {first_difference}", order.len())
        }
        StepTime(t) => format!(
            "{:.1} ms: compute {:.1}, h2d wait {:.1}, d2h wait {:.1}, stalls {:.1}, optimizer {:.1}",
            t.step_ms,
            t.compute_ms,
            t.h2d_wait_ms,
            t.d2h_wait_ms,
            t.weight_stall_ms + t.restore_stall_ms,
            t.optimizer_ms
        ),
        TelemetryLost { sink, lost, reason, .. } => format!("{sink} lost {lost} events: {reason}"),
        NonFinite { block, tensor } => match block {
            Some(b) => format!("non-finite {tensor} in block {b}"),
            None => format!("non-finite {tensor}"),
        },
        FlightRecorded { reason, path, events } => format!("{events} events to {path} ({reason})"),
    }
}

/// The wire name of a policy rule.
pub fn rule_name(r: PolicyRule) -> &'static str {
    match r {
        PolicyRule::Reset => "reset",
        PolicyRule::BackwardPressure => "backward_pressure",
        PolicyRule::OptimizerProtection => "optimizer_protection",
        PolicyRule::Contention => "contention",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_events_and_hints() {
        let d = describe(&EventKind::Residency {
            block: BlockId(3),
            from: BlockState::Prefetching,
            to: BlockState::GpuReady,
            refcount: 1,
        });
        assert_eq!(d, "#3 prefetching -> gpu_ready ref=1");
        let h = fmt_hints(&Hints { max_inflight_h2d: Some(1), suppress_speculative: true, ..Default::default() });
        assert_eq!(h, "h2d<=1 d2h<=- window<=- no-speculative");
        let t = describe(&EventKind::TransferCompleted {
            id: TransferId(7),
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes: 48 << 20,
            duration_ms: Some(2.5),
        });
        assert_eq!(t, "h2d #7 weights 48.0 MiB in 2.50 ms");
        let untimed = describe(&EventKind::TransferCompleted {
            id: TransferId(8),
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes: 48 << 20,
            duration_ms: None,
        });
        assert_eq!(untimed, "h2d #8 weights 48.0 MiB (not timed)");
    }
}
