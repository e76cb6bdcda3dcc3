"""What talks across devices: the prefix/suffix merges of the devices' affine state maps."""
