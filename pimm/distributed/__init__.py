"""Multi-process plumbing: local process launch and rank-aware samplers."""
