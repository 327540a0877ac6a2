"""The project's own chaos suite (issue 13): damage, kills, tamperings and a full disk against real parts."""
