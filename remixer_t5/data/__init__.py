"""Data side: embedded corpus, vocabularies and span corruption (no model imports)."""
