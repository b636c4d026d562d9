"""Generation: the only stage that talks to MLX (mlx-lm for text rows, mlx-vlm for media rows)."""
