"""The PodResources v1 proto (api.proto) and its generated stubs: do not edit the stubs, regenerate them
(`make podresources-stubs`)."""
