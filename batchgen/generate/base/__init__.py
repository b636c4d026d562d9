"""What every room of generate/ uses: typed MLX values, checkpoint facts, row bounds, the plan-aside rule."""
