"""The shipped demo: the reference agent, the small shop service its tools call, and the
walkthrough `durably demo` runs."""
