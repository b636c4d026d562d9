"""What every stage shares: records, errors, parameters, settings, constraint specs, the memo, URIs."""
