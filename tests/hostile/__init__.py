"""Every entry point against hostile input: refused with a clear error, nothing stored."""
