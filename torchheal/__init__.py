"""torchheal: per-step fault tolerance for PyTorch training."""
