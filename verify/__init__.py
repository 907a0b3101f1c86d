"""verify: certify any attention kernel against the float64 reference."""
