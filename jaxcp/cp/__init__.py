"""What talks across devices: the strategies behind one call (``strategies``), the
cross-device step of the delta rule and the merges of the devices' affine state maps, the
head all-to-all baseline, the layouts of the sequence's pieces, and the conv halo."""
