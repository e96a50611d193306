"""Reading a real launch line (torchrun and Megatron flags), its layer splits, and the problems
`check` reports. Pure Python."""
