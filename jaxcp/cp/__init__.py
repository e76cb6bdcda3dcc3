"""What talks across devices: the prefix/suffix merges of the devices' affine state maps, the
head all-to-all baseline, and the conv halo."""
