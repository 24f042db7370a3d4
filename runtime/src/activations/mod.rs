//! Activation Stagehand: spill saved tensors to a size-class pinned pool and restore them ahead of backward.
