// Module for the two tiny static programs Berth's mini cluster packs into images of its own: the
// pod sandbox (pause) and the e2e test workload (testapp). It has no dependencies.
module github.com/berth-k8s/berth/build/podbin

go 1.25.0
