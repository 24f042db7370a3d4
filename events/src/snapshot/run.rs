//! Run lifecycle, phases and steps, and the run's health (warnings, drops, losses, incidents).

use super::super::model::*;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::RunStarted {
            run_id,
            wall_clock_unix_ms,
            device,
            model,
            versions,
            config,
        } => {
            s.run = Some(RunInfo {
                run_id: clip(run_id),
                wall_clock_unix_ms: *wall_clock_unix_ms,
                device: DeviceInfo {
                    name: clip(&device.name),
                    ..device.clone()
                },
                model: clip(model),
                versions: versions.clone(),
                config: config.clone(),
            });
            s.ended = false;
        }
        EventKind::RunEnded { .. } => s.ended = true,
        EventKind::PhaseChanged { from, to, .. } => {
            if *from != Phase::Idle && *from != *to {
                push_bounded(
                    &mut s.phase_spans,
                    PhaseSpan {
                        step: e.step,
                        phase: *from,
                        start_ns: s.phase_started_ns,
                        end_ns: e.t_ns,
                    },
                    PHASE_SPANS,
                );
            }
            s.phase = *to;
            s.phase_started_ns = e.t_ns;
            s.step = e.step;
            if *to == Phase::StepBegin {
                s.step_record_mut(e.step);
            }
        }
        EventKind::TrainStep(m) => {
            s.vram_peak_bytes = s.vram_peak_bytes.max(m.vram_peak_bytes);
            s.step_record_mut(e.step).train = Some(m.clone());
        }
        EventKind::StepTime(t) => s.step_record_mut(e.step).time = Some(*t),
        EventKind::Warning { source, message } => push_bounded(
            &mut s.warnings,
            WarningRecord {
                seq: e.seq,
                t_ns: e.t_ns,
                step: e.step,
                source: *source,
                message: clip(message),
            },
            RECENT_WARNINGS,
        ),
        EventKind::EventsDropped { total } => s.dropped_events = s.dropped_events.max(*total),
        EventKind::TelemetryLost { lost, .. } => {
            s.telemetry_lost = s.telemetry_lost.saturating_add(*lost);
        }
        EventKind::NonFinite { block, tensor } => {
            bump_text(&mut s.non_finite, tensor);
            if s.first_non_finite_block.is_none() {
                s.first_non_finite_block = *block;
            }
        }
        EventKind::FlightRecorded { path, reason, .. } => {
            // The dump an out-of-memory triggered is announced after it: the report names it.
            if reason == "out_of_memory" {
                if let Some(o) = s.out_of_memory.back_mut().filter(|o| o.dump.is_none()) {
                    o.dump = Some(clip(path));
                }
            }
            push_bounded(&mut s.flight_records, clip(path), RECENT_INCIDENTS);
        }
        _ => {}
    }
}
