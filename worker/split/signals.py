"""What a split rank process and the node that supervises it tell each other (no MLX here, so
the node can use it without loading MLX).

- rank 0 prints :data:`WAKE_LINE` on stdout when its dozing ranks must rejoin the ring; the
  node then writes one byte to each dozing rank's stdin (through the rank's order stream for a
  rank on another node);
- a rank exits with :data:`GROUP_BROKEN` when its group broke (a peer gone, a step overdue);
- :data:`LOCKSTEP_VERSION` names the wire the ranks speak to each other.
"""

WAKE_LINE = "split rank 0: wake the followers"
# The lockstep wire (worker/serve/split_rank.py: header size, inline payload, ops). Every rank of a
# group must speak the same one; a head's rank order says which it speaks.
LOCKSTEP_VERSION = 3
GROUP_BROKEN = 3
