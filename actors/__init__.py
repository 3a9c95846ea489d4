"""The trio runtime: intake, journal, folding and lease-holder actors over memory channels."""
