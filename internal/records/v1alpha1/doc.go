// Package v1alpha1 is version v1alpha1 of Berth's record API (group records.berth.dev): the
// custom resources in which the cluster keeps its memory of machines and join attempts. Machine is
// one object per attested machine the joinservice admitted; JoinRecord is the refusals of one
// machine or peer for one reason, aggregated. The CustomResourceDefinitions that serve them are
// built in package records; the typed clients and apply configurations are generated from these
// types (make generate-records).
//
// +k8s:deepcopy-gen=package
// +groupName=records.berth.dev
package v1alpha1
