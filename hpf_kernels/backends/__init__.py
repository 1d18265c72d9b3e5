"""Newton-Schulz backends. Each module exposes newton_schulz(X, coefficients, *, norm_scale, eps,
compute_dtype) over a [..., m, n] tensor; hpf_kernels.newton_schulz picks one by device type."""
