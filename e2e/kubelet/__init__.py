"""A small kubelet for the e2e cluster: runs the pods bound to its node as local processes."""
