"""The worker process and its HTTP face: the command line (main), the routes (app), the socket
(net), the start-up warm-up, and a split rank's process entry (split_rank)."""
