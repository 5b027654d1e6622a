"""dflashkit: DFlash drafters."""
