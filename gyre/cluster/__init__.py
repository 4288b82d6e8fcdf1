"""Where the cells live: in this process (the default) or as Ray actors (gyre/cluster/remote.py)."""
