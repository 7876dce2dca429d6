"""The DataLoader: the rules for every loader value (policy), fitting them to the built data, building
the loaders (process or thread workers, item or batch fetch), measuring them, and the tuner's search."""
