"""What a layer keeps in memory and how it streams into it: `store` (packed codes and parameters, exact byte counts),
`streams` (KIVI's streaming policies: the exact window, per-channel blocks, per-token flushes), `rows` (the
left-padded prefill layout the packed and recompute layers share)."""
