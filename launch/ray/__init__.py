"""`tandem ray`: the fleet on a Ray cluster (launcher, plan, placement, members, roles, fleet controller, control, and the local cluster it starts when none is named)."""
