"""Where a row runs: the batched text and vision lanes, the one-row lanes, speculation, scoring."""
