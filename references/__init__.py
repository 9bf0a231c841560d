"""Plain FP64 reference implementations that the correctness checks compare against."""
