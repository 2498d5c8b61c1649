"""What every kernel shares: the launcher, masking helpers, TMA descriptors, the work scheduler, tile
sizes and launch records, device queries and integer math."""
