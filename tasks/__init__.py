"""seqio task registrations for remixer_t5."""
