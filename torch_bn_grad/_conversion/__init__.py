"""Model conversion: torch's BatchNorms to this library's (``convert.py``), fused with
the activation after them (``fuse.py``), back to torch's (``revert.py``), and folded
into the convolutions before them (``fold.py``); ``fuse_sites.py`` finds what ``fuse.py`` fuses."""
