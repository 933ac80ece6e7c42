"""The seam every source of episodes enters through: the source protocol, its context and
conversations as token sequences (`chat`)."""
