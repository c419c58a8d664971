"""Everything that only training and evaluation need (never imported by the remote-code files)."""
