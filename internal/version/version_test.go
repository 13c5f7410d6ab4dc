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
