"""The Megatron integration (torch and megatron-core): install(), the calculator, the guards, the loss contract,
finalize, the training-loop hooks, auxiliary losses, and the compatibility fingerprints."""
