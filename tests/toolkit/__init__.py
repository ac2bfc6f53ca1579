"""The toolkit: freezing, detaching, cloning and the audits that prove what a loss reaches."""
