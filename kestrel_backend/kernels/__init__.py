"""Every Triton GPU kernel of the engine, and the packed 4-bit weight format they read. model/ is the models' math in
PyTorch and runtime/ the engine's machinery; both call into here, and nothing here imports them."""
