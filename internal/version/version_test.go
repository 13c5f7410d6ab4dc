package version

import (
	"runtime/debug"
	"testing"
)

func TestCommitOf(t *testing.T) {
	for _, tc := range []struct {
		settings []debug.BuildSetting
		want     string
	}{
		{[]debug.BuildSetting{{Key: "vcs.revision", Value: "abc"}, {Key: "vcs.modified", Value: "false"}}, "abc"},
		{[]debug.BuildSetting{{Key: "vcs.revision", Value: "abc"}, {Key: "vcs.modified", Value: "true"}}, "abc-dirty"},
		{[]debug.BuildSetting{{Key: "vcs.modified", Value: "true"}}, "unknown"},
		{nil, "unknown"},
	} {
		if got := commitOf(tc.settings); got != tc.want {
			t.Errorf("commitOf(%v) = %q, want %q", tc.settings, got, tc.want)
		}
	}
}

func TestDateOf(t *testing.T) {
	for _, tc := range []struct {
		settings []debug.BuildSetting
		want     string
	}{
		{[]debug.BuildSetting{{Key: "vcs.time", Value: "2026-11-21T07:00:00+01:00"}}, "2026-11-21T06:00:00Z"},
		{[]debug.BuildSetting{{Key: "vcs.time", Value: "yesterday"}}, "unknown"},
		{[]debug.BuildSetting{{Key: "vcs.revision", Value: "abc"}}, "unknown"},
		{nil, "unknown"},
	} {
		if got := dateOf(tc.settings); got != tc.want {
			t.Errorf("dateOf(%v) = %q, want %q", tc.settings, got, tc.want)
		}
	}
}

func TestLinkerValuesWin(t *testing.T) {
	defer func(c, d string) { GitCommit, BuildDate = c, d }(GitCommit, BuildDate)
	GitCommit, BuildDate = "0123abc-dirty", "2026-11-21T06:00:00Z"
	if Commit() != GitCommit || Date() != BuildDate {
		t.Fatalf("Commit() = %q, Date() = %q: the values the Makefile stamps must win", Commit(), Date())
	}
}
