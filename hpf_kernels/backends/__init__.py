"""Newton-Schulz backends. Each module exposes newton_schulz(X, coefficients, *, norm_scale, eps,
compute_dtype, gram) over a [..., m, n] tensor (gram: the Gram iteration); hpf_kernels.newton_schulz
picks one by device type."""
