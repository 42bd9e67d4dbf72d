"""Test-side instruments shared by the test files: a host-sync counter and a float64 guard (each a PyTorch
``TorchFunctionMode``/``TorchDispatchMode`` that records what a block of code asks of the tensors it runs)."""
