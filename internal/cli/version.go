package cli

import (
	"fmt"
	"io"
	"runtime"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/version"
)

// versionReport is what berth version prints. With -o json|yaml its field names are stable.
type versionReport struct {
	// Version is the release version (git describe of the build: a tag, or tag-N-gCOMMIT).
	Version string `json:"version"`
	// GitCommit is the commit built, with "-dirty" when the tree had changes; "unknown" without.
	GitCommit string `json:"gitCommit"`
	// BuildDate is the source date of the build, RFC 3339 UTC (SOURCE_DATE_EPOCH, else the commit's
	// date); "unknown" without.
	BuildDate string `json:"buildDate"`
	// GoVersion is the Go toolchain that built the binary.
	GoVersion string `json:"goVersion"`
	// Platform is GOOS/GOARCH.
	Platform string `json:"platform"`
}

func currentVersion() versionReport {
	return versionReport{
		Version: version.Version, GitCommit: version.Commit(), BuildDate: version.Date(),
		GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH,
	}
}

func newVersionCmd() *cobra.Command {
	var output outputFormat
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print berth's version, commit, build date, Go version and platform",
		Long: `version prints which build of berth this is. make build stamps the version (git describe),
the commit and the build date (SOURCE_DATE_EPOCH, else the commit's date, so that a commit always
builds the same binary); a plain go build knows only what the Go toolchain recorded.`,
		Example: `  berth version
  berth version -o json | jq -r .gitCommit`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			v := currentVersion()
			if output.structured() {
				return output.encode(cmd.OutOrStdout(), v)
			}
			printVersion(cmd.OutOrStdout(), v)
			return nil
		},
	}
	addOutputFlag(cmd.Flags(), &output)
	return cmd
}

func printVersion(out io.Writer, v versionReport) {
	_, _ = fmt.Fprintf(out, "berth %s\n  git commit: %s\n  build date: %s\n  go version: %s\n  platform:   %s\n",
		v.Version, v.GitCommit, v.BuildDate, v.GoVersion, v.Platform)
}
