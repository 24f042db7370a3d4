//! Weight Stagehand: stream weights block by block through a bounded pinned pool.
