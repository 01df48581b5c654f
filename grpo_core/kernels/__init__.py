"""Optimisation: skip on first read.

CPU fast paths that change how fast the math runs, never what it computes (tests compare each against
the plain model forward): `fused_decode`, the sampling forward (fused weights on 2 MiB pages, built
when sampling starts); `lean_decode`, a Llama-family forward with a preallocated KV cache, the sampler's
fallback and the packed update trunk; `cpu_linear`, fp32 linears through oneDNN with each frozen
weight packed once. `cpu_features` says which of them this CPU can run, for the code and the tests;
`settings` holds the run's choices among them (the config's `kernels:` section); `kernel_probes` times the
candidates where a choice is auto, and keeps what decided for the run's records.
"""
