"""Model architectures implemented in plain torch."""
