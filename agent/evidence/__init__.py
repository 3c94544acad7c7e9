"""What a rank leaves behind for the collector when asked: the diagnostic
bundle and the on-demand step profile. Reads the watches and checks below."""
