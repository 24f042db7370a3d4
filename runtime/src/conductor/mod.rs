//! Conductor: phases, budgets, PCIe slots and policy hints across the runtimes.
