"""Draft-head training on top of the engine: target replies (data), online target features (features),
training-time test (ttt), trainer, held-out evaluation (evaluate) and the one-command pipeline (pipeline)."""
