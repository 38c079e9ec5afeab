"""The audit stream: its events, the file and hash chain that keep them, checks and exports."""
