"""Optimisation: skip on first read.

CPU fast paths that change how fast the math runs, never what it computes (tests compare each against
the plain model forward): `lean_decode`, a Llama-family forward with a preallocated KV cache used for
sampling and for the packed update trunk; `cpu_linear`, fp32 linears through oneDNN with each frozen
weight packed once.
"""
